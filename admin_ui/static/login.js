// The sign-in page works as a plain form; this only shows why the last attempt failed.
if (new URLSearchParams(location.search).has("error")) {
  document.getElementById("error").hidden = false;
}
