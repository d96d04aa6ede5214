import sys

from strata_jax.bench.cli import main

sys.exit(main())
