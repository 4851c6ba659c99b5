"""The browser client (``index.html``, ``app.js``, ``style.css``), installed as the package
``server.web_client`` so that the server serves it from a wheel as from a checkout."""
