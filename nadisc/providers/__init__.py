"""Built-in providers: ``static`` and ``dns``."""
