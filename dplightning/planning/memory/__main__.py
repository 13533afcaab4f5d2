"""``python -m dplightning.planning.memory``: the ``dplightning memory-plan`` command, from the planner's old path.

Guarded, so that importing this module (``pkgutil.walk_packages`` does) runs nothing.
"""

if __name__ == "__main__":
    import sys

    from dplightning.commands.memory_plan import main

    sys.exit(main())
