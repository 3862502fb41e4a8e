"""Calls every RPC of the CSI services with an empty request over a
unix socket, as grpcio for Python does, and prints one line per call:
`<Service>/<Method> <CODE>`.

usage: csi_calls.py SOCKET PROTO AUTHORITY
  SOCKET: a unix socket's path, or tcp://HOST:PORT.
  AUTHORITY: `socket` sends the socket path as :authority (what kubelet
  before 1.26 and csc send), `default` leaves grpcio's own default (newer
  grpcio sends the path percent-encoded), anything else is sent as given.
"""

import importlib
import os
import shutil
import sys
import tempfile

import grpc
from grpc_tools import protoc


def main():
    socket, proto, authority = sys.argv[1:4]
    # The stubs are generated into a folder of their own, removed once
    # they are loaded and the calls made.
    out = tempfile.mkdtemp(prefix="csi-py-")
    try:
        call_all(socket, proto, authority, out)
    finally:
        shutil.rmtree(out, ignore_errors=True)


def call_all(socket, proto, authority, out):
    include = os.path.join(os.path.dirname(protoc.__file__), "_proto")
    rc = protoc.main([
        "protoc",
        f"-I{os.path.dirname(proto)}",
        f"-I{include}",
        f"--python_out={out}",
        f"--grpc_python_out={out}",
        proto,
    ])
    if rc != 0:
        sys.exit(f"protoc failed: {rc}")
    sys.path.insert(0, out)
    messages = importlib.import_module("csi_pb2")
    stubs = importlib.import_module("csi_pb2_grpc")

    options = []
    if authority == "socket":
        options.append(("grpc.default_authority", socket))
    elif authority != "default":
        options.append(("grpc.default_authority", authority))
    if socket.startswith("tcp://"):
        # Plain TCP; `socket` sends the endpoint's URL as :authority, as
        # csc does.
        channel = grpc.insecure_channel(socket[len("tcp://"):], options=options)
    else:
        channel = grpc.insecure_channel(f"unix://{socket}", options=options)
    for service in messages.DESCRIPTOR.services_by_name.values():
        stub = getattr(stubs, f"{service.name}Stub")(channel)
        for method in service.methods:
            request = getattr(messages, method.input_type.name)()
            try:
                answer = getattr(stub, method.name)(request, timeout=10)
                # A server stream answers as it is read.
                if hasattr(answer, "__next__"):
                    list(answer)
                code = "OK"
            except grpc.RpcError as e:
                code = e.code().name
                if code == "INTERNAL":
                    code += f" ({e.details()})"
            print(f"{service.name}/{method.name} {code}", flush=True)


main()
