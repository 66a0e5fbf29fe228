"""The example project's URLs plus views whose costs cannot take effect or sit on a class, and
the example's 4-seat report under ``i18n_patterns`` (``/en/localized/2024/``,
``/fr/localized/2024/``)."""

from django.conf.urls.i18n import i18n_patterns
from django.http import HttpResponse
from django.urls import include, path
from django.views import View

from apf_gunicorn import django as apf_django
from apf_gunicorn import flask as apf_flask
from examples.mysite import views


@apf_flask.cost(seats=3)  # the Flask decorator: a Django app never reads it
def misplaced(request):
    return HttpResponse("misplaced\n")


@apf_django.cost(seats=2, final_seats=1, additional_latency="10ms")
class Exports(View):
    def get(self, request):
        return HttpResponse("export\n")

    def post(self, request):
        return HttpResponse("created\n")


urlpatterns = [
    path("", include("examples.mysite.urls")),
    path("misplaced/", misplaced),
    path("exports/", Exports.as_view()),
    *i18n_patterns(path("localized/<int:year>/", views.report)),
]
