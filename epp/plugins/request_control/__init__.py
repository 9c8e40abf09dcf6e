"""Built-in request-control plugins (request-header processors, screeners, admitters, reporters)."""
