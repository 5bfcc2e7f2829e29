"""How often the dev round's paired 95% t interval (evaluation/dev_tables.py) excludes 0 under a flat truth.

Per sample a latent accuracy u ~ Beta(a, b); our press answers eight phases ~ Binomial(8, u) / 8, KVzip one answer
~ Bernoulli(u), so the true mean difference is 0. Prints the false-positive rate per sample count and Beta shape.

    python benchmarks/simulate_paired_null.py --runs 4000 [--samples 96,48]
"""

from __future__ import annotations

import argparse

import numpy as np
from scipy import stats


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=4000)
    parser.add_argument("--samples", default="96,48", help="comma-separated sample counts (default 96,48: the dev "
                        "round; the fresh split's pooled rows have 32)")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    for n in (int(x) for x in args.samples.split(",")):
        for a, b in ((0.5, 0.5), (5, 1), (1, 5), (0.2, 0.2)):
            fired = 0
            for _ in range(args.runs):
                u = rng.beta(a, b, n)
                d = rng.binomial(8, u) / 8 - rng.binomial(1, u)
                se = d.std(ddof=1) / np.sqrt(n)
                if se == 0:
                    continue
                half = stats.t.ppf(0.975, n - 1) * se
                fired += (d.mean() - half > 0) or (d.mean() + half < 0)
            print(f"n={n} Beta({a}, {b}): the interval excludes 0 in {fired / args.runs:.2%} of runs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
