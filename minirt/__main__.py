"""``python -m minirt``: the ``minirt`` command line."""
from .cli import app

app(prog_name="minirt")
