"""Prepare geo3k data: convert the real geo3k parquet from a local path, or draw synthetic problems.

python scripts/prepare_geo3k.py --parquet /data/geo3k/train-*.parquet --out data/geo3k
python scripts/prepare_geo3k.py --synthetic 200 --out data/geo3k_synthetic
"""

import sys

from slime_mt.cli import main

if __name__ == "__main__":
    sys.exit(main(["prepare-data", *sys.argv[1:]]))
