"""An ``APF_REQUEST_INFO`` hook that changes nothing: the built-in resolver's answer, through
the hook path (a configuration the worker's poller cannot classify, so every request reaches
the middleware on a thread)."""


def request_info(environ):
    return {}
