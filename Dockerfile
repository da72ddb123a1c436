# syntax=docker/dockerfile:1
#
# One image, two entrypoints: ttlab-server and ttlab-reaper (plus ttlabctl for migrations
# and operator tasks). The guest agent is built with the size-optimised `agent` profile and
# installed where the server reads it to embed into every VM's cloud-init
# (TTLAB_AGENT_BINARY=/usr/local/bin/ttlab-agent).
#
#   docker build -t ghcr.io/ttlab/ttlab:0.1.0 .
#   containers: command ["/usr/local/bin/ttlab-server"] or ["/usr/local/bin/ttlab-reaper"]
#
# The builder is Debian 12 (glibc 2.36) and so is the runtime (distroless cc): the server and
# reaper link the same glibc they run on. The agent runs in the *guest*, which may be older:
# bins/agent/measure-size.sh fails the build if it needs a glibc symbol newer than 2.34 or
# if it would not fit the cloud-init Secret.

ARG RUST_VERSION=1.95

# The pages' one runtime dependency, xterm.js (and its fit addon), from npm at the versions
# pinned in web/package-lock.json. The server serves TTLAB_WEB_DIR's pages, static/, and
# /vendor/{xterm,addon-fit} from its node_modules/@xterm/ (crates/api/src/web.rs).
FROM docker.io/library/node:22-bookworm-slim AS web
WORKDIR /web
COPY web/package.json web/package-lock.json ./
RUN npm ci --omit=dev --ignore-scripts --no-audit --no-fund
COPY web/ ./
RUN set -eux; \
    mkdir -p /out/node_modules/@xterm; \
    cp index.html admin.html /out/; \
    cp -r static /out/static; \
    cp -r node_modules/@xterm/xterm node_modules/@xterm/addon-fit /out/node_modules/@xterm/

FROM docker.io/library/rust:${RUST_VERSION}-bookworm AS build
WORKDIR /src
# objdump for the agent's glibc check (binutils is in the image; listed for clarity).
RUN apt-get update -qq && apt-get install -y -qq --no-install-recommends binutils \
    && rm -rf /var/lib/apt/lists/*
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target,sharing=locked \
    set -eux; \
    cargo build --locked --release -p ttlab-server-bin -p ttlab-reaper-bin; \
    # ttlabctl without its dev-tools (sim, demo, bench, soak and kube-sim): only what
    # production runs (migrate, render, token).
    cargo build --locked --release -p ttlab-ttlabctl-bin --no-default-features; \
    bins/agent/measure-size.sh; \
    mkdir -p /out/bin; \
    cp target/release/ttlab-server target/release/ttlab-reaper target/release/ttlabctl /out/bin/; \
    cp target/agent/ttlab-agent /out/bin/; \
    mkdir -p /out/share/lessons; \
    cp lessons/*.yaml /out/share/lessons/

# distroless: glibc, CA certificates, tzdata, no shell; uid/gid 65532 ("nonroot").
FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /out/bin/ /usr/local/bin/
COPY --from=build /out/share/ /usr/share/ttlab/
COPY --from=web /out/ /usr/share/ttlab/web/
ENV TTLAB_AGENT_BINARY=/usr/local/bin/ttlab-agent \
    TTLAB_LESSONS=/usr/share/ttlab/lessons \
    TTLAB_WEB_DIR=/usr/share/ttlab/web \
    TTLAB_LISTEN=0.0.0.0:8080
USER 65532:65532
EXPOSE 8080 9090
ENTRYPOINT ["/usr/local/bin/ttlab-server"]
