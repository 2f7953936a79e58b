# idempotency-ledger: build with cargo, run on a slim Debian as a non-root user.
#   docker build -t idempotency-ledger .
#   docker run --rm -p 127.0.0.1:8080:8080 \
#     -e LEDGER__POSTGRES__URL=postgres://postgres@db:5432/idempotency_ledger \
#     -e LEDGER__REDIS__URL=redis://cache:6379 idempotency-ledger
#
# The locked dependencies need Rust 1.89 or newer.
ARG RUST_VERSION=1.93

# 1. Only the manifests: Cargo.lock and every Cargo.toml of the build (the
#    root package and any workspace members, e.g. clients/rust), without the
#    separate fuzz workspace. This stage reruns on every change, but its
#    output changes only when a manifest does, so the dependency layer below
#    stays cached while only sources change.
FROM rust:${RUST_VERSION}-bookworm AS manifests
WORKDIR /src
COPY . .
RUN mkdir -p /manifests \
 && cp Cargo.lock /manifests/ \
 && find . -name Cargo.toml -not -path './target/*' -not -path './fuzz/*' \
      -exec cp --parents {} /manifests/ \;

FROM rust:${RUST_VERSION}-bookworm AS builder
WORKDIR /build
# 2. The dependencies, built against placeholder sources: every target path a
#    manifest names (src/main.rs, tests/api/main.rs, ...) and a src/lib.rs per
#    package get an empty `fn main() {}`. The placeholders are removed again.
COPY --from=manifests /manifests/ ./
RUN set -eu; : > /tmp/placeholders; \
    for manifest in $(find . -name Cargo.toml -not -path './target/*'); do \
      dir=$(dirname "$manifest"); \
      for file in $(grep -o 'path *= *"[^"]*\.rs"' "$manifest" | sed 's/.*"\(.*\)"/\1/') src/lib.rs; do \
        if [ ! -e "$dir/$file" ]; then \
          mkdir -p "$(dirname "$dir/$file")"; echo 'fn main() {}' > "$dir/$file"; echo "$dir/$file" >> /tmp/placeholders; \
        fi; \
      done; \
    done; \
    cargo build --release --locked; \
    xargs rm -f < /tmp/placeholders
# 3. The sources (the binary embeds config/, migrations/ and src/lua/ at
#    compile time). COPY keeps the files' own mtimes, which may be older than
#    the placeholder build: touch them so cargo rebuilds our crates.
COPY . .
RUN find . -path ./target -prune -o -name '*.rs' -type f -exec touch {} + \
 && cargo build --release --locked \
 && cp target/release/idempotency-ledger /usr/local/bin/idempotency-ledger

FROM debian:bookworm-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 ledger \
 && useradd --system --uid 10001 --gid ledger --no-create-home --shell /usr/sbin/nologin ledger
COPY --from=builder /usr/local/bin/idempotency-ledger /usr/local/bin/idempotency-ledger
# Numeric, so that runAsNonRoot policies can check it without /etc/passwd.
USER 10001:10001
# The embedded default listens on 127.0.0.1, unreachable from outside a container.
ENV LEDGER__SERVER__LISTEN=0.0.0.0:8080
EXPOSE 8080
# No HEALTHCHECK here: the image also runs one-off commands (migrate,
# reconcile). `idempotency-ledger health` is the check for `serve` (see
# docker-compose.yml).
ENTRYPOINT ["idempotency-ledger"]
CMD ["serve"]
