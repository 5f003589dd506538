#!/bin/bash
# Reward 1 when mean() and median() in /app/stats.py give the right answers, else 0.
mkdir -p /logs/verifier
if python3 - <<'PY'
import sys

sys.path.insert(0, "/app")
import stats

assert stats.mean([1, 2, 3, 4]) == 2.5, stats.mean([1, 2, 3, 4])
assert stats.mean([5]) == 5
assert stats.mean([-1, 1]) == 0
assert stats.median([3, 1, 2]) == 2
assert stats.median([4, 1, 3, 2]) == 2.5
PY
then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
