#!/bin/bash
# Reward 1 when /app/answer.txt names the most frequent word of the staged data ("the", 4).
mkdir -p /logs/verifier
if [ "$(cat /app/answer.txt 2>/dev/null)" = "the 4" ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo "expected 'the 4' in /app/answer.txt, got '$(cat /app/answer.txt 2>/dev/null)'" >&2
  echo 0 > /logs/verifier/reward.txt
fi
