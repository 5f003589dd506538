#!/bin/bash
set -euo pipefail
tr -s '[:space:]' '\n' < /app/data/words.txt | grep -v '^$' | sort | uniq -c | sort -k1,1nr -k2 \
  | head -n 1 | awk '{print $2, $1}' > /app/answer.txt
