"""The generation process: a Celery worker serving its models' queues (solo pool).

One engine loop per served model runs in a thread for as long as the worker lives
(`engine_host`, started by `hosts`); online requests reach it from the relay (`pump`),
batch lines through a `process` task (`runner`), whose lease runs in the lease child
(`lease_process`: this process's end of the pipe) or, embedded, in threads here.
`embedding` is the engine host's contract over an embedding model.
"""
