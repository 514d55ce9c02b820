"""TRL's GRPOTrainer on the demo's task: see streamrl/benchmarks/trl_baseline.py (kept in the
package so that ``streamrl bench vs-trl`` can run it from an installed streamrl).

    python bench/trl_copy.py [--lr 5e-4] [--max-steps 1500] [--seed 0] [--threads 2]
"""

from streamrl.benchmarks.trl_baseline import main

if __name__ == "__main__":
    main()
