// amp-course's one JupyterLab plugin, written by hand (no build step): `make lab` passes this folder
// as --LabApp.extra_labextensions_path (course_lib/tooling/lab.py says why).
//
// A notebook opened with saved widget state turned "modified" 1-1.5 s after it loaded, with nothing
// changed: @jupyter-widgets/jupyterlab-manager restores each saved widget model and, with "Save
// Widget State Automatically" on (the course turns it on so bars reopen as they ended), marks the
// document dirty for every model it registers. The rule here holds by construction: whenever the
// document turns dirty while its contents equal what was last read from or written to disk, it is
// not dirty. Running a cell or editing one changes the contents, so those stay modified.
//
// JupyterLab loads a federated extension as a webpack container: window._JUPYTERLAB[name] with
// init(shareScope) and get(module) -> factory -> module (jupyterlab/staging/bootstrap.js).
// Renaming this file (remoteEntry.N.js, and "load" in package.json) is needed after any change:
// JupyterLab serves extension files as immutable, so a browser keeps the old one.
(function () {
  "use strict";
  var lab = (window._JUPYTERLAB = window._JUPYTERLAB || {});

  function contents(model) {
    return JSON.stringify(model.toJSON());
  }

  function watch(widget, seen) {
    var context = widget && widget.context;
    if (!context || !context.model || seen.has(context)) return;
    seen.add(context);
    context.ready.then(function () {
      var model = context.model;
      var onDisk = contents(model); // as read: the widget manager has not restored anything yet
      context.fileChanged.connect(function () {
        onDisk = contents(model); // saved (or reverted): the new baseline
      });
      model.stateChanged.connect(function (sender, change) {
        if (change.name === "dirty" && change.newValue === true && contents(model) === onDisk) {
          model.dirty = false;
        }
      });
    });
  }

  var plugin = {
    id: "amp-course-lab:unchanged-is-not-dirty",
    description: "A notebook whose contents equal the file on disk is not marked modified.",
    autoStart: true,
    activate: function (app) {
      var seen = new WeakSet();
      function scan() {
        var it = app.shell.widgets("main");
        for (var w = it.next(); !w.done; w = it.next()) watch(w.value, seen);
      }
      app.restored.then(scan);
      app.shell.layoutModified.connect(scan);
      app.shell.currentChanged.connect(scan);
    },
  };

  lab["amp-course-lab"] = {
    init: function () {
      return Promise.resolve(); // shares nothing and needs nothing shared
    },
    get: function (module) {
      if (module !== "./extension") {
        return Promise.reject(new Error('Module "' + module + '" does not exist in container.'));
      }
      return Promise.resolve(function () {
        return { __esModule: true, default: plugin };
      });
    },
  };
})();
