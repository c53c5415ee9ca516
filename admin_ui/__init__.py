"""The admin dashboard's static files (HTML, JavaScript modules, CSS), served at /admin."""
