#!/usr/bin/env bash
# Session 24's calls ran this file's plans, since moved to bench/device_calls.sh (the script as each call ran it: the
# commit README.md lists for it).
exec bash bench/device_calls.sh "$@"
