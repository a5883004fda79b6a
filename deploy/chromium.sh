#!/usr/bin/env bash
# Debian's Chromium and chromedriver for the dashboard's browser test (tests/dashboard/test_browser.py),
# installed when missing: with them absent the test fails under CI rather than skipping.
set -euo pipefail
if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then
    exit 0
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO=sudo; fi
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium chromium-driver >/dev/null
command -v chromium && command -v chromedriver
