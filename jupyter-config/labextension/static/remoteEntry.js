/* gpulab's JupyterLab extension, written by hand (no build step): a launcher card
 * "Train a model" that opens the ready notebook gpulab copies into every person's folder
 * (examples/Train a model.ipynb, see gpulab.extensions.serverext.offer_examples). The server
 * extension puts its path below the server's root in the page config (gpulabTrainNotebook);
 * without it (no such notebook there) there is no card.
 *
 * It is a module-federation container as JupyterLab 4 loads them (its bootstrap calls
 * init(shareScope), then get("./extension")): the launcher's token (ILauncher) and PageConfig
 * are taken from JupyterLab's own shared @jupyterlab/launcher and @jupyterlab/coreutils, so
 * the card lands in the real launcher.
 *
 * A second plugin, gpulab-launcher:idle-notice, shows the gpulab service's GPU-idle warnings
 * about this server as JupyterLab notifications (Notification from @jupyterlab/apputils): it
 * asks the server extension's <base_url>gpulab/idle (gpulab.extensions.idlenotice) once at
 * start and every POLL_SECONDS, shows each warning once, with the time the server will be
 * stopped and a "Keep for N hours" button (N: the operator's c.GPUIdle.keep_max_hours) that
 * POSTs <base_url>gpulab/idle/keep; a refusal is an error notification with the service's
 * words. A warning that is gone (the GPUs were used, the server was kept) is dismissed. */
var _JUPYTERLAB;
(function () {
  "use strict";
  var PAGE_CONFIG_KEY = "gpulabTrainNotebook";
  var COMMAND = "gpulab:train-a-model";
  var ICON = "data:image/svg+xml," + encodeURIComponent(
    '<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 24 24">' +
    '<rect x="1" y="1" width="22" height="22" rx="4" fill="#f37524"/>' +
    '<path d="M5 17l4-5 3 3 5-8 2 2" stroke="#fff" stroke-width="2" fill="none" ' +
    'stroke-linecap="round" stroke-linejoin="round"/></svg>');
  var scope = null;

  function shared(name) {
    // the highest version JupyterLab shares of `name`
    var versions = (scope && scope[name]) || {};
    var keys = Object.keys(versions).sort(function (a, b) {
      var x = a.split(/[.-]/).map(Number), y = b.split(/[.-]/).map(Number);
      for (var i = 0; i < Math.max(x.length, y.length); i++) {
        var d = (x[i] || 0) - (y[i] || 0);
        if (d) return d;
      }
      return 0;
    });
    if (!keys.length) return Promise.reject(new Error("JupyterLab shares no " + name));
    return Promise.resolve(versions[keys[keys.length - 1]].get()).then(function (f) { return f(); });
  }

  function plugin(launcherModule, coreutils) {
    return {
      id: "gpulab-launcher:train-a-model",
      description: "A launcher card that opens gpulab's ready notebook, Train a model.ipynb",
      autoStart: true,
      requires: [launcherModule.ILauncher],
      activate: function (app, launcher) {
        var NOTEBOOK = coreutils.PageConfig.getOption(PAGE_CONFIG_KEY);
        if (!NOTEBOOK) return;
        app.commands.addCommand(COMMAND, {
          label: "Train a model",
          caption: "Open " + NOTEBOOK + ": distributed TensorFlow training on the hub's GPUs",
          execute: function () {
            return app.commands.execute("docmanager:open", { path: NOTEBOOK });
          }
        });
        launcher.add({ command: COMMAND, category: "Notebook", rank: 50, kernelIconUrl: ICON });
      }
    };
  }

  var IDLE_PATH = "gpulab/idle";
  var KEEP_PATH = "gpulab/idle/keep";
  var POLL_SECONDS = 30;

  function clock(seconds) {
    return new Date(seconds * 1000).toLocaleTimeString([], { hour: "2-digit", minute: "2-digit" });
  }

  function hoursText(hours) {
    return hours + (hours === 1 ? " hour" : " hours");
  }

  function idlePlugin(apputils, services, coreutils) {
    var Notification = apputils.Notification;
    var ServerConnection = services.ServerConnection;
    return {
      id: "gpulab-launcher:idle-notice",
      description: "Notifications for this server's idle GPUs, with a Keep button",
      autoStart: true,
      requires: [],
      activate: function (app) {
        var settings = ServerConnection.makeSettings();
        var shown = {};  // warning key -> notification id

        function call(path, init) {
          var url = coreutils.URLExt.join(settings.baseUrl, path);
          return ServerConnection.makeRequest(url, init || {}, settings).then(function (r) {
            return r.text().then(function (text) {
              var body = {};
              try { body = text ? JSON.parse(text) : {}; } catch (e) { body = {}; }
              if (!r.ok) {
                throw new Error(body.message || ("gpulab answered " + r.status));
              }
              return body;
            });
          });
        }

        function keep(key, hours) {
          return call(KEEP_PATH, { method: "POST", body: JSON.stringify({ hours: hours }) })
            .then(function (answer) {
              Notification.dismiss(shown[key]);
              Notification.success("This server is kept until " + clock(answer.kept_until) +
                ": GPU-idle culling holds off.", { autoClose: 8000 });
            }, function (err) {
              delete shown[key];  // shown again at the next look, if still warned
              Notification.error("Could not keep this server: " + err.message,
                                 { autoClose: false });
            });
        }

        function show(notice, maxHours) {
          var key = notice.id + ":" + notice.stop_at;
          if (shown[key]) return key;
          var gpus = notice.gpus === 1 ? "its GPU sits" : "its " + notice.gpus + " GPUs sit";
          var message = notice.stop_at
            ? "GPUs idle: this server will be stopped at " + clock(notice.stop_at) + " (" +
              gpus + " idle) unless they are used or you keep it."
            : "GPUs idle: " + gpus + " idle; please stop this server if you do not need them.";
          var actions = [];
          if (notice.can_keep && maxHours > 0) {
            actions.push({
              label: "Keep for " + hoursText(maxHours),
              caption: "Hold off GPU-idle culling of this server for " + hoursText(maxHours),
              displayType: "accent",
              callback: function () { keep(key, maxHours); }
            });
          }
          shown[key] = Notification.warning(message, { autoClose: false, actions: actions });
          return key;
        }

        function look() {
          return call(IDLE_PATH).then(function (view) {
            var now = {};
            (view.notices || []).forEach(function (n) {
              now[show(n, view.keep_max_hours)] = true;
            });
            Object.keys(shown).forEach(function (key) {
              if (!now[key]) {  // no longer warned: used again, kept, or stopped
                Notification.dismiss(shown[key]);
                delete shown[key];
              }
            });
          }, function (err) {
            console.warn("gpulab: GPU-idle warnings not read:", err.message);
          });
        }

        function loop() {
          look().then(function () { window.setTimeout(loop, POLL_SECONDS * 1000); });
        }
        app.restored.then(loop);
      }
    };
  }

  _JUPYTERLAB = window._JUPYTERLAB = window._JUPYTERLAB || {};
  _JUPYTERLAB["gpulab-launcher"] = {
    init: function (shareScope) { scope = shareScope; },
    get: function (module) {
      if (module !== "./extension" && module !== "./index") {
        return Promise.reject(new Error("gpulab-launcher has no module " + module));
      }
      return Promise.all([shared("@jupyterlab/launcher"), shared("@jupyterlab/coreutils"),
                          shared("@jupyterlab/apputils"), shared("@jupyterlab/services")])
        .then(function (modules) {
          var found = [plugin(modules[0], modules[1]),
                       idlePlugin(modules[2], modules[3], modules[1])];
          return function () { return { __esModule: true, default: found }; };
        });
    }
  };
})();
