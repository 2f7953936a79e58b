# idempotency-ledger: build with cargo, run on a slim Debian as a non-root user.
#   docker build -t idempotency-ledger .
#   docker run --rm -p 8080:8080 \
#     -e LEDGER__POSTGRES__URL=postgres://postgres@db:5432/idempotency_ledger \
#     -e LEDGER__REDIS__URL=redis://cache:6379 idempotency-ledger
#
# Cargo.toml says rust-version 1.88, but the locked dependencies (actix-web
# 4.18, uuid 1.29) need 1.89 or newer, so the builder is newer than that.
ARG RUST_VERSION=1.93

FROM rust:${RUST_VERSION}-bookworm AS builder
WORKDIR /build
# The whole tree (minus .dockerignore): Cargo.toml names the test target's
# path, and the binary embeds config/, migrations/ and src/lua/ at compile time.
COPY . .
RUN cargo build --release --locked

FROM debian:bookworm-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 ledger \
 && useradd --system --uid 10001 --gid ledger --no-create-home --shell /usr/sbin/nologin ledger
COPY --from=builder /build/target/release/idempotency-ledger /usr/local/bin/idempotency-ledger
USER ledger:ledger
# The embedded default listens on 127.0.0.1, unreachable from outside a container.
ENV LEDGER__SERVER__LISTEN=0.0.0.0:8080
EXPOSE 8080
ENTRYPOINT ["idempotency-ledger"]
CMD ["serve"]
