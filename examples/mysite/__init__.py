"""A small Django project served by apf_gunicorn, with per-view costs (README "Django").

    DJANGO_SETTINGS_MODULE=examples.mysite.settings \
    APF_CONFIG=examples/mysite/apf.yaml \
    gunicorn -c python:apf_gunicorn.conf -w 2 --threads 8 examples.mysite.wsgi:application

``/reports/<year>/`` costs 4 seats (``@cost`` from :mod:`apf_gunicorn.django`) on the
``reports`` level, whose ``apf-gunicorn.io/max-seats: "4"`` annotation lets a request that
wide through on an 8-seat server; ``/api/v1/items/`` is a REST path, classified like any other
path under this configuration (it has no resource rules).
"""
