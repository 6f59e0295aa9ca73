"""A fork's files: the manifest of a tree, its snapshot, its build on a worker, its changes and the sandbox."""
