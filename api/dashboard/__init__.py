"""The web dashboard, served by the API app under ``/dashboard``: static pages (``pages/``)
whose scripts (``static/``) read the REST API with the same bearer tokens, which the login page
keeps in the browser's local storage. Everything it loads ships in the package, Chart.js
included (``static/vendor/``), so it works offline and needs no build step."""
