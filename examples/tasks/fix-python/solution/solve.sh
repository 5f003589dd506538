#!/bin/bash
set -euo pipefail
sed -i 's|return sum(values) / (len(values) - 1)|return sum(values) / len(values)|' /app/stats.py
