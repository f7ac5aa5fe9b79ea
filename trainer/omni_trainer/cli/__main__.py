"""``python -m omni_trainer.cli``: the same app as the ``omni`` console script."""

from omni_trainer.cli import app

if __name__ == "__main__":
    app()
