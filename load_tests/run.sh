#!/usr/bin/env bash
# A bounded headless locust run with CSV + HTML reports.
#
#   load_tests/run.sh USERS SPAWN_RATE DURATION HOST [USER_CLASS ...]
#   load_tests/run.sh 4 4 30s http://localhost:8000                   # HTTP /generate user
#   GRPC_PORT=8001 load_tests/run.sh 4 4 30s http://localhost:8000 GrpcStreamUser
#
# Reports go to $OUT_DIR (default out/locust/): locust_stats.csv, locust_failures.csv, ...,
# report.html. Exits non-zero if any request failed or none completed.
set -uo pipefail

if [ $# -lt 4 ]; then
    echo "usage: $0 USERS SPAWN_RATE DURATION HOST [USER_CLASS ...]" >&2
    exit 2
fi
users=$1 spawn_rate=$2 duration=$3 host=$4
shift 4
here=$(cd "$(dirname "$0")" && pwd)
out=${OUT_DIR:-out/locust}
locust=${LOCUST:-$(command -v locust || echo "$here/../.venv/bin/locust")}
mkdir -p "$out"

"$locust" -f "$here/locustfile.py" --headless -u "$users" -r "$spawn_rate" -t "$duration" \
    --host "$host" --stop-timeout 120 --only-summary \
    --csv "$out/locust" --html "$out/report.html" "$@"
code=$?

# Aggregated row of the stats CSV: Type,Name,Request Count,Failure Count,...
read -r requests failures < <(awk -F, '$2 == "Aggregated" { print $3, $4 }' "$out/locust_stats.csv" 2>/dev/null)
echo "locust: ${requests:-0} requests, ${failures:-?} failures; reports in $out/"
if [ "$code" -ne 0 ]; then
    exit "$code"
fi
if [ "${failures:-1}" != "0" ] || [ "${requests:-0}" = "0" ]; then
    exit 1
fi
