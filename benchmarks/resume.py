"""Time to resume (issue 34): from a fresh process to its first training step, phase by
phase, against each phase's limit and orbax in the same run. The benchmark itself is
``time_to_step.py`` (its docstring says what each part measures); this is its name in
the issue:

    python benchmarks/resume.py [--part phases|steps|memory|jobs] [--procs 4] [--reps 3] ...
"""

import os
import runpy

if __name__ == "__main__":
    runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "time_to_step.py"), run_name="__main__")
