"""The memory worker's entry point (`python -m poise_lab.bench.overhead JSON`, see `memory.measure_memory`)."""

import json
import sys

from .memory import memory_worker
from .timing import Row

request = json.loads(sys.argv[1])
rows = [Row(**row) for row in request["rows"]]
print(json.dumps(memory_worker(request["algorithm"], rows, request["settings"])))
