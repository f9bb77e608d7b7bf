"""Model in, graphs out: sources, architecture specs, graph building, validation, bundles."""
