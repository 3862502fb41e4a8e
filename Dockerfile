# ferrovol: a statically small image with the driver and the tools its
# backends call (losetup, blkid, mkfs/resize for ext4 and xfs).
FROM rust:1-bookworm AS build
WORKDIR /src
COPY Cargo.toml Cargo.lock build.rs ./
COPY proto proto
COPY src src
RUN cargo build --release --locked && strip target/release/ferrovol

FROM debian:bookworm-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends util-linux mount e2fsprogs xfsprogs lvm2 coreutils \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /src/target/release/ferrovol /usr/local/bin/ferrovol
ENTRYPOINT ["/usr/local/bin/ferrovol"]
CMD ["serve"]
