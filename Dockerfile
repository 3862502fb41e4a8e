# ferrovol's image: the release binary, built by an unprivileged user, in a
# slim Debian runtime with the tools the backends run and nothing else.
#
#   docker build -t ferrovol:0.1.0 .

FROM rust:1-bookworm AS build
RUN useradd --create-home --uid 10001 builder
USER 10001:10001
# The crates registry in the builder's home, not the toolchain's.
ENV CARGO_HOME=/home/builder/.cargo
WORKDIR /home/builder/src
COPY --chown=10001:10001 Cargo.toml Cargo.lock build.rs ./
COPY --chown=10001:10001 proto proto
COPY --chown=10001:10001 benches benches
COPY --chown=10001:10001 src src
RUN cargo build --release --locked --bin ferrovol \
 && strip target/release/ferrovol

FROM debian:bookworm-slim
# The release's version (Cargo.toml's; tests/docs.rs keeps them equal).
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="ferrovol" \
      org.opencontainers.image.version="${VERSION}"
# What each backend runs (tests/deploy.rs keeps this list and the code in
# step): util-linux and mount (blkid, findmnt, losetup, mount, wipefs,
# blkdiscard, blockdev), e2fsprogs, xfsprogs and btrfs-progs (make, check,
# grow and re-UUID filesystems; xfs_quota for nfs), lvm2 (lvm, the iscsi
# store), dmsetup (iscsi hold devices, thin pool messages),
# thin-provisioning-tools (thin_dump, thin_delta: lvm changed block
# tracking), cryptsetup-bin (LUKS2 encryption on the nodes), open-iscsi and multipath-tools (iscsi nodes), nfs-common
# (mount.nfs), zstd (nfs snapshots' archives), ceph-common (rbd). The iscsi controller speaks to the host's
# tgtd over its management socket itself: no tgt package. Versions follow the Debian release; pinning each
# would break the build at every point release.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends \
      util-linux mount e2fsprogs xfsprogs btrfs-progs lvm2 dmsetup \
      thin-provisioning-tools cryptsetup-bin open-iscsi multipath-tools nfs-common zstd ceph-common \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /home/builder/src/target/release/ferrovol /usr/local/bin/ferrovol
ENTRYPOINT ["/usr/local/bin/ferrovol"]
CMD ["serve"]
