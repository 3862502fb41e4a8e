"""The floor of the rbd controller calls: librbd itself, on one open
connection (Ceph's Python binding: each step is one librbd call), timed
step by step. Prints one JSON object: each step's times in milliseconds.

usage: librbd_floor.py CONF KEYRING USER POOL PREFIX VOLUMES SNAPSHOTS SIZE
"""

import json
import sys
import time

import rados
import rbd


def main():
    conf, keyring, user, pool, prefix = sys.argv[1:6]
    volumes, snapshots, size = (int(a) for a in sys.argv[6:9])
    cluster = rados.Rados(
        conffile=conf,
        rados_id=user,
        conf={"keyring": keyring, "rbd_default_clone_format": "2"},
    )
    cluster.connect()
    io = cluster.open_ioctx(pool)
    r = rbd.RBD()
    times = {}

    def timed(step, f):
        start = time.monotonic()
        f()
        times.setdefault(step, []).append((time.monotonic() - start) * 1e3)

    names = [f"{prefix}-{i}" for i in range(volumes)]
    for n in names:
        timed("create", lambda: r.create(io, n, size, old_format=False, features=rbd.RBD_FEATURE_LAYERING))
    for n in names[:snapshots]:
        def snap():
            with rbd.Image(io, n) as img:
                img.create_snap("cut")
        timed("snapshot", snap)
    for n in names[:snapshots]:
        timed("clone", lambda: r.clone(io, n, "cut", io, n + "-clone", features=rbd.RBD_FEATURE_LAYERING))
    for n in names[:snapshots]:
        timed("remove clone", lambda: r.remove(io, n + "-clone"))
    for n in names[:snapshots]:
        def unsnap():
            with rbd.Image(io, n) as img:
                img.remove_snap("cut")
        timed("remove snapshot", unsnap)
    for n in names:
        timed("remove", lambda: r.remove(io, n))
    io.close()
    cluster.shutdown()
    print(json.dumps(times))


if __name__ == "__main__":
    main()
