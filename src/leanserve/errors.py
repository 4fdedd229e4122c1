"""Errors that end an engine (a light module: the CLI imports it before torch)."""


class StageFailure(RuntimeError):
    """A pipeline stage died or could not start; the engine cannot continue."""


class EngineDied(RuntimeError):
    """The engine behind the server stopped (e.g. a pipeline stage died); the server has shut down."""
