import json, sys
from experiments import bench_attention as b
from pallas_kernels.pope_attention_config import default_block_sizes
b.VARIANTS = {"bench_h64": [default_block_sizes(64)], "bench_h128": [default_block_sizes(128)]}
rows = b.variants(10)
json.dump(rows, open(sys.argv[1], "w"), indent=1)
