"""The training command line's parts: config, data, model, loop, metrics, checkpoints, reports.

Small pieces composed by :func:`bigbatch.train.loop.train`; the library never imports the CLI.
"""
