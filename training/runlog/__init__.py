"""The run directory: its file names (``files``), step metrics and events (``metrics``), restart
phases (``phases``), what the time was spent on (``accounting``), the report, TensorBoard
scalars and the run's verdict. Torch-free, so the report runs anywhere the files are."""
