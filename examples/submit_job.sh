#!/usr/bin/env bash
# Run `ray-fsdp train` as a Ray job on a running cluster.
#
#   examples/submit_job.sh [CONFIG] [--set key=value ...]
#
# RAY_ADDRESS is the cluster's dashboard (default http://127.0.0.1:8265): a head
# started on this machine, or a tunnel to a remote one (`ray dashboard
# cluster_configs/aws.yaml`, or `kubectl port-forward svc/ray-fsdp-head-svc 8265`).
# The cluster uses token authentication: the token comes from RAY_AUTH_TOKEN,
# RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token, exactly as for the `ray` CLI.
#
# The repository is uploaded as the job's working directory, so the job runs
# this checkout's code (`python -m ray_fsdp_backend.cli` is `ray-fsdp`
# without needing the package installed on the cluster).
set -euo pipefail
cd "$(dirname "$0")/.."
config="${1:-examples/cpu_tiny.yaml}"
shift $(( $# > 0 ? 1 : 0 ))
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-token}"
exec ray job submit \
    --address "${RAY_ADDRESS:-http://127.0.0.1:8265}" \
    --working-dir . \
    -- python -m ray_fsdp_backend.cli train "$config" "$@"
