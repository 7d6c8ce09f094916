"""The ``vllm`` command: ``main.py`` dispatches to one module per subcommand (``serve.py``)."""
