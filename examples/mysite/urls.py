"""URLconf of the example project."""

from django.urls import path
from django.views.decorators.csrf import csrf_exempt

from examples.mysite import views

urlpatterns = [
    path("reports/<int:year>/", views.report),
    path("items/", csrf_exempt(views.Items.as_view())),
    path("api/v1/items/", csrf_exempt(views.Items.as_view())),
    path("healthz", views.healthz),
]
