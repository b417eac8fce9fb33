#!/usr/bin/env bash
# Debian's Chromium for the browser tests: the study report page (tests/integration/test_study.py)
# and MLflow's own UI (tests/integration/test_mlflow_ui.py).
# Idempotent: does nothing when /usr/bin/chromium is there. Needs root (apt), as CI has.
set -euo pipefail
if command -v chromium >/dev/null 2>&1; then
    echo "chromium: $(chromium --version 2>/dev/null)"
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get install -y -q chromium >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q chromium >/dev/null; }
echo "chromium: installed $(chromium --version 2>/dev/null)"
