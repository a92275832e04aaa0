"""The book's tooling: exercise checks, experiments and the attention explorer.

It imports the library core (``attnlib``); the core never imports it. Its optional
dependencies (ipywidgets, nbclient, nbformat) come with ``pip install "attnlib[book]"``.
"""
