"""The ``zero`` console script: ``zero run`` (launch a training job) and ``zero env``
(report the installation, like DeepSpeed's ``ds_report``). Entry point: ``cli.main``;
``python -m zero_core.launcher`` is the same command."""
