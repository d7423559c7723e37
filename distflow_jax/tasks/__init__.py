"""Built-in verifiable tasks (dataset generators) for the default run.

``registry`` maps task names to tasks (``builtin:<task>[:<level>]`` in
``data.train`` / ``data.eval``); ``arithmetic`` is the one built in.
"""
