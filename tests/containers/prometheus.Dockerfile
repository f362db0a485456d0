# A Prometheus server for the container tests: Debian's `prometheus` package
# on the same base as the colod images (no other registry is reachable here).
ARG BASE=docker.io/library/debian:12-slim
FROM ${BASE}
RUN set -eux; \
    apt-get update; \
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus; \
    apt-get clean; \
    rm -rf /var/lib/apt/lists/*
USER prometheus
EXPOSE 9090
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/colod-prometheus/prometheus.yml", "--storage.tsdb.path=/tmp/prometheus", \
     "--web.listen-address=:9090"]
