# Redis for the retrieval replicas' shared cache and upstream budget (compose profile `redis`,
# docs/stack.md): Debian's redis-server (7.0 on bookworm) on the stack's own base image, as
# the other images are built, so it builds where no image registry is reachable too.
#
#   docker build -f docker/redis.Dockerfile -t hdr-redis .
#
# It persists to an append-only file in /data (a volume), fsynced on every write by default
# (`--appendfsync always`; `everysec` is faster and may lose the last second of writes if the
# host crashes), and evicts only keys that expire (`volatile-lru`: the answers, never the
# budget) once `--maxmemory` is reached: what `hdr serve` requires of a Redis that keeps an
# upstream budget. Reached on the compose network only (no port published), so it runs without
# a password and with protected mode off; it runs as Debian's `redis` user.
#
# Build argument: BASE_IMAGE  python:3.11-slim  any Debian-like image with apt-get

ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends redis-server \
    && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /var/cache/apt/archives/*.deb \
    && mkdir -p /data \
    && chown redis:redis /data
USER redis
VOLUME ["/data"]
WORKDIR /data
EXPOSE 6379
HEALTHCHECK --interval=5s --timeout=3s --retries=5 CMD ["redis-cli", "ping"]
# HDR_REDIS_MAXMEMORY and HDR_REDIS_APPENDFSYNC (compose passes them) set the two that vary;
# arguments after the image name are added to redis-server's.
ENV HDR_REDIS_MAXMEMORY=1gb \
    HDR_REDIS_APPENDFSYNC=always
ENTRYPOINT ["sh", "-c", "exec redis-server --bind 0.0.0.0 --protected-mode no --dir /data --appendonly yes --maxmemory-policy volatile-lru --maxmemory \"$HDR_REDIS_MAXMEMORY\" --appendfsync \"$HDR_REDIS_APPENDFSYNC\" \"$@\"", "redis-server"]
