"""Moved to the ``planner`` package: ``python -m planner``. Kept so old commands still run."""

if __name__ == "__main__":
    from planner.cli import main

    raise SystemExit(main())
