"""train.py with the plug-ins of my_plugins.py and their YAML options on Hydra's search path.

    python examples/plugin/train_plugins.py model=mlp data=stripes optim=rmsprop optim.schedule=linear distributed.num_gpus=2
"""

import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
# my_plugins, train.py of the checkout and its ddpscale, which my_plugins imports first: the
# ddpscale that train.py beside it runs, not another one installed
PATHS = [str(HERE), str(HERE.parents[1]), str(HERE.parents[1] / "src")]
sys.path[:0] = PATHS
# hydra/launcher=slurm's tasks unpickle train.main and the config (whose schema classes
# name my_plugins) from any working directory
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [*PATHS, os.environ.get("PYTHONPATH")]))

if __name__ == "__main__":  # (a spawned worker's command line has it already)
    # conf/model/mlp.yaml, ... on the search path: an override next to the user's own, as
    # Hydra takes overrides only as one run of arguments (`-m model=mlp` or `model=mlp -m`);
    # before train.py checks the command line, which then finds these options too
    overrides = [i for i, arg in enumerate(sys.argv[1:], 1) if "=" in arg and not arg.startswith("-")]
    sys.argv.insert(overrides[0] if overrides else len(sys.argv), f"hydra.searchpath=[file://{HERE / 'conf'}]")

import my_plugins  # noqa: E402,F401  (registers the model, the data set, the optimizer and the schedule)
import train  # noqa: E402

if __name__ == "__main__":
    train.main()
