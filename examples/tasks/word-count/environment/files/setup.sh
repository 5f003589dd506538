# Sourced once before the agent starts: put the staged data where the instruction says.
mkdir -p /app/data
cp "$HARBOR_STAGING/words.txt" /app/data/words.txt
