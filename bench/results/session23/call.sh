#!/usr/bin/env bash
# Session 23's calls ran this file as it was at the commits README.md lists; its plans live on in
# bench/device_calls.sh, where `auto` now maps otherwise (an H200: step_serve; an H100: h100).
exec bash bench/device_calls.sh "$@"
