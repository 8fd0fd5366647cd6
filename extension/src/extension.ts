// fuselens VS Code client. Thin by design: it starts the Python language server, routes
// commands to it, and renders what it sends (diagnostics, code lens and code actions come
// straight from the server through vscode-languageclient; the side panel and the virtual
// kernel / transformed-code documents come from the custom requests fuselens/*).
import * as path from 'path';
import * as fs from 'fs';
import * as os from 'os';
import * as cp from 'child_process';
import * as crypto from 'crypto';
import * as vscode from 'vscode';
import {
  CloseAction, ErrorAction, ExecuteCommandRequest, LanguageClient, LanguageClientOptions,
  ServerOptions, State, TransportKind, WorkDoneProgress, WorkDoneProgressCancelNotification,
} from 'vscode-languageclient/node';

const SCHEME = 'fuselens';
let client: LanguageClient | undefined;
let output: vscode.LogOutputChannel;
let tree: FunctionsProvider;
let treeView: vscode.TreeView<Node>;
let kernelDocs: KernelDocs;
let status: vscode.StatusBarItem;
const restarts: number[] = [];

// ------------------------------------------------------------------ server process

// The server's state, shown by the status item whatever file is active.
type ServerState = { kind: 'starting'; python: string } | { kind: 'ready'; python: string }
  | { kind: 'failed'; reason: string; python?: string };
let serverState: ServerState = { kind: 'starting', python: '' };

// What the server imports, by module; pip's names for the ones the extension offers to install
// (torch is the user's choice of build: the extension never installs it).
const NEEDED = ['pygls', 'lsprotocol', 'libcst', 'torch'];
const PIP_NAMES: Record<string, string> = { pygls: 'pygls>=2,<3', lsprotocol: 'lsprotocol', libcst: 'libcst' };

type Interpreter = { command: string; origin: string };

function workspaceVenv(): string | undefined {
  const bin = process.platform === 'win32' ? path.join('Scripts', 'python.exe') : path.join('bin', 'python');
  for (const f of vscode.workspace.workspaceFolders ?? []) {
    for (const dir of ['.venv', 'venv']) {
      const exe = path.join(f.uri.fsPath, dir, bin);
      if (fs.existsSync(exe)) { return exe; }
    }
  }
  return undefined;
}

function insideWorkspace(exe: string): boolean {
  const abs = path.resolve(exe);
  return (vscode.workspace.workspaceFolders ?? []).some(f => abs.startsWith(f.uri.fsPath + path.sep));
}

async function pythonExtensionApi(): Promise<any | undefined> {
  const py = vscode.extensions.getExtension('ms-python.python');
  if (!py) { return undefined; }
  try {
    return py.isActive ? py.exports : await py.activate();
  } catch (e) {
    output.appendLine(`fuselens: could not ask the Python extension for its interpreter: ${e}`);
    return undefined;
  }
}

// The interpreter users expect: the setting; else the Python extension's selected one; else a
// .venv/venv in the workspace; else python3. In restricted mode an interpreter inside the
// workspace is the workspace's code, so it is not run.
async function findInterpreter(): Promise<Interpreter> {
  const configured = vscode.workspace.getConfiguration('fuselens').get<string>('pythonPath', '').trim();
  if (configured) { return { command: configured, origin: 'the fuselens.pythonPath setting' }; }
  const trusted = vscode.workspace.isTrusted;
  const api = await pythonExtensionApi();
  if (api?.environments) {
    try {
      const envPath = api.environments.getActiveEnvironmentPath?.(vscode.workspace.workspaceFolders?.[0]?.uri);
      const env = envPath ? await api.environments.resolveEnvironment(envPath) : undefined;
      const exe: string | undefined = env?.executable?.uri?.fsPath ?? envPath?.path;
      if (exe && (trusted || !insideWorkspace(exe))) { return { command: exe, origin: "the Python extension's selected interpreter" }; }
      if (exe) { output.appendLine(`fuselens: restricted mode: not starting ${exe} (inside the workspace)`); }
    } catch (e) {
      output.appendLine(`fuselens: could not ask the Python extension for its interpreter: ${e}`);
    }
  }
  const venv = workspaceVenv();
  if (venv && trusted) { return { command: venv, origin: 'the workspace\'s virtual environment' }; }
  if (venv) { output.appendLine(`fuselens: restricted mode: not starting ${venv} (inside the workspace)`); }
  return { command: process.platform === 'win32' ? 'python' : 'python3', origin: 'the default (no interpreter selected, no .venv in the workspace)' };
}

type Check = { ok: true } | { ok: false; reason: string; missing: string[] };

// Asks the interpreter what it lacks (find_spec: nothing is imported, so it takes ~50 ms).
function checkInterpreter(py: Interpreter): Promise<Check> {
  const script = 'import sys, json, importlib.util as u\n' +
    `m = [n for n in ${JSON.stringify(NEEDED)} if u.find_spec(n) is None]\n` +
    'if "pygls" not in m:\n' +
    '    from importlib.metadata import version\n' +
    '    try:\n        v = int(version("pygls").split(".")[0])\n    except Exception:\n        v = 0\n' +
    '    if v < 2: m.append("pygls>=2")\n' +
    'print(json.dumps({"missing": m, "version": list(sys.version_info[:2])}))';
  return new Promise(resolve => {
    cp.execFile(py.command, ['-c', script], { timeout: 30_000, cwd: os.tmpdir(), env: { ...process.env, PYTHONSAFEPATH: '1' } },
      (err, stdout, stderr) => {
        if (err && (err as any).code === 'ENOENT') {
          resolve({ ok: false, missing: [], reason: `"${py.command}" (${py.origin}) was not found` });
          return;
        }
        try {
          const r = JSON.parse(stdout.trim().split('\n').pop() ?? '');
          const [maj, min] = r.version;
          if (maj < 3 || (maj === 3 && min < 10)) {
            resolve({ ok: false, missing: [], reason: `${py.command} (${py.origin}) is Python ${maj}.${min}; fuselens needs 3.10 or newer` });
          } else if (r.missing.length) {
            resolve({ ok: false, missing: r.missing.map((m: string) => m.replace('>=2', '')),
              reason: `${py.command} (${py.origin}) lacks ${r.missing.join(', ')}` });
          } else {
            resolve({ ok: true });
          }
        } catch {
          resolve({ ok: false, missing: [], reason: `${py.command} (${py.origin}) did not run: ${(stderr || String(err)).trim().split('\n').pop()}` });
        }
      });
  });
}

function setState(s: ServerState): void {
  serverState = s;
  updateStatus();
}

let notified = '';  // the failure last notified: the same one is not shown again

async function notifyFailure(py: Interpreter | undefined, check: { reason: string; missing: string[] }): Promise<void> {
  if (notified === check.reason) { return; }
  notified = check.reason;
  const installable = check.missing.filter(m => m in PIP_NAMES);
  const buttons: string[] = [];
  if (await pythonExtensionApi()) { buttons.push('Select interpreter'); }
  buttons.push('Open setting');
  if (py && installable.length && vscode.workspace.isTrusted) { buttons.push(`Install ${installable.join(', ')}`); }
  const what = check.missing.includes('torch')
    ? ' It needs torch (install the build for your machine) and pygls 2, lsprotocol and libcst.'
    : ' It needs pygls 2, lsprotocol, libcst and torch.';
  const pick = await vscode.window.showErrorMessage(
    `fuselens: the language server cannot start: ${check.reason}.${what} Select an interpreter that has them, ` +
    'set "fuselens.pythonPath", or install what is missing.', ...buttons);
  if (pick === 'Select interpreter') {
    await vscode.commands.executeCommand('python.setInterpreter');
  } else if (pick === 'Open setting') {
    await vscode.commands.executeCommand('workbench.action.openSettings', 'fuselens.pythonPath');
  } else if (pick && py) {
    await pipInstall(py, installable);
  }
}

// pip, on the user's click, with progress; the result shown, and the server started after.
async function pipInstall(py: Interpreter, modules: string[]): Promise<void> {
  const specs = modules.map(m => PIP_NAMES[m]);
  output.appendLine(`fuselens: ${py.command} -m pip install ${specs.join(' ')}`);
  const result = await vscode.window.withProgress(
    { location: vscode.ProgressLocation.Notification, title: `fuselens: installing ${modules.join(', ')} into ${py.command}`, cancellable: true },
    (_p, token) => new Promise<{ code: number | null; tail: string }>(resolve => {
      const child = cp.spawn(py.command, ['-m', 'pip', 'install', ...specs], { cwd: os.tmpdir() });
      let tail = '';
      const take = (b: Buffer) => { const s = b.toString(); output.append(s); tail = (tail + s).slice(-2000); };
      child.stdout.on('data', take);
      child.stderr.on('data', take);
      child.on('error', e => resolve({ code: -1, tail: String(e) }));
      child.on('close', code => resolve({ code, tail }));
      token.onCancellationRequested(() => child.kill());
    }));
  if (result.code === 0) {
    void vscode.window.showInformationMessage(`fuselens: installed ${modules.join(', ')}; starting the language server.`);
    notified = '';
    await restartServer();
  } else {
    const last = result.tail.trim().split('\n').filter(Boolean).pop() ?? '';
    void vscode.window.showErrorMessage(`fuselens: pip could not install ${modules.join(', ')} into ${py.command}: ${last}`, 'Show output')
      .then(b => { if (b) { output.show(); } });
  }
}

function settingsObject(): any {
  // a plain JSON copy of the fuselens.* settings, for the server
  const c = vscode.workspace.getConfiguration('fuselens');
  return {
    informationSeverity: c.get('informationSeverity'),
    uncompiledFunctions: c.get('uncompiledFunctions'),
    worker: { timeLimitSeconds: c.get('worker.timeLimitSeconds') },
    exampleInputs: { discovery: c.get('exampleInputs.discovery') },
  };
}

let extensionContext: vscode.ExtensionContext;
let starting: Promise<void> | undefined;

// The last Compile & benchmark run of each function, kept in the workspace's state so that a
// window reload (which restarts the server) shows it again: with its "as run" diagnostics and
// counts if its file has not changed since, marked stale if it has.
const RUNS_KEY = 'fuselens.lastRuns';
type SavedRun = { uri: string; qualname: string; textHash: string; summary: any };

function textHash(text: string): string {
  return crypto.createHash('sha256').update(text).digest('hex');
}

async function saveRun(uri: string, summary: any): Promise<void> {
  const doc = vscode.workspace.textDocuments.find(d => d.uri.toString() === uri);
  if (!doc || typeof summary.qualname !== 'string') { return; }
  const saved = extensionContext.workspaceState.get<SavedRun[]>(RUNS_KEY, [])
    .filter(s => !(s.uri === uri && s.qualname === summary.qualname));
  saved.push({ uri, qualname: summary.qualname, textHash: textHash(doc.getText()), summary });
  await extensionContext.workspaceState.update(RUNS_KEY, saved.slice(-20));
}

function savedRuns(): any[] {
  const out: any[] = [];
  for (const s of extensionContext.workspaceState.get<SavedRun[]>(RUNS_KEY, [])) {
    try {
      const text = fs.readFileSync(vscode.Uri.parse(s.uri).fsPath, 'utf8');
      out.push({ ...s.summary, stale: textHash(text) !== s.textHash });
    } catch { /* the file is gone: so is its run */ }
  }
  return out;
}

// Stops the server (if any) and starts it again: on a setting, interpreter or trust change.
async function restartServer(): Promise<void> {
  if (starting) { await starting.catch(() => undefined); }
  restarts.length = 0;
  const old = client;
  client = undefined;
  if (old) { await old.stop().catch(() => undefined); }
  starting = startClient(extensionContext);
  await starting;
}

async function startClient(ctx: vscode.ExtensionContext): Promise<void> {
  const py = await findInterpreter();
  setState({ kind: 'starting', python: py.command });
  const check = await checkInterpreter(py);
  if (!check.ok) {
    output.appendLine(`fuselens: not starting the language server: ${check.reason}`);
    setState({ kind: 'failed', reason: check.reason, python: py.command });
    void notifyFailure(check.missing.length ? py : undefined, check);
    return;
  }
  notified = '';
  const python = py.command;
  // The .vsix bundles the server and the compiler; in a development checkout they are the
  // repository's own folders. Either way they go first on PYTHONPATH.
  const bundled = [path.join(ctx.extensionPath, 'server'), path.join(ctx.extensionPath, 'compiler')]
    .filter(p => fs.existsSync(p));
  const env: NodeJS.ProcessEnv = { ...process.env };
  env.PYTHONPATH = [...bundled, env.PYTHONPATH].filter(Boolean).join(path.delimiter);
  // Never import from the current folder (a workspace could shadow torch or fuselens_lsp).
  env.PYTHONSAFEPATH = '1';
  output.appendLine(`fuselens: starting the language server: ${python} -m fuselens_lsp (${py.origin})`);
  const serverOptions: ServerOptions = {
    command: python, args: ['-m', 'fuselens_lsp'], transport: TransportKind.stdio,
    options: { env, cwd: os.tmpdir() },
  };
  const clientOptions: LanguageClientOptions = {
    documentSelector: [{ language: 'python', scheme: 'file' }, { language: 'python', scheme: 'untitled' }],
    outputChannel: output,
    synchronize: { configurationSection: 'fuselens' },
    // a function: a server restarted after a crash gets the saved runs too
    initializationOptions: () => ({ settings: settingsObject(), trusted: vscode.workspace.isTrusted, runs: savedRuns() }),
    // one notification of ours (the status item says the rest), not the client's generic ones
    initializationFailedHandler: () => false,
    errorHandler: {
      error: () => ({ action: ErrorAction.Continue, handled: true }),
      closed: () => {
        const now = Date.now();
        restarts.push(now);
        while (restarts.length && now - restarts[0] > 180_000) { restarts.shift(); }
        if (restarts.length <= 5) {
          setState({ kind: 'starting', python });
          output.appendLine('fuselens: the language server stopped; restarting it');
          return { action: CloseAction.Restart, handled: true };
        }
        const reason = `the language server (${python}) stopped 5 times in 3 minutes`;
        setState({ kind: 'failed', reason, python });
        return { action: CloseAction.DoNotRestart, message: `fuselens: ${reason} and is not restarted. ` +
          'See the "fuselens" output, then run "fuselens: Restart language server".' };
      },
    },
  };
  const mine = new LanguageClient('fuselens', 'fuselens', serverOptions, clientOptions);
  client = mine;
  mine.onDidChangeState(e => {
    if (client !== mine) { return; }
    if (e.newState === State.Running) {
      setState({ kind: 'ready', python });
      void mine.sendNotification('fuselens/setTrusted', { trusted: vscode.workspace.isTrusted });
      tree.refreshSoon();
      kernelDocs.refreshOpen();
    } else if (e.newState === State.Starting) {
      setState({ kind: 'starting', python });
    }
  });
  mine.onNotification('fuselens/didChange', () => tree.refreshSoon());
  try {
    await mine.start();
  } catch (e) {
    const reason = `the language server did not start with ${python}: ${String(e).split('\n')[0]}`;
    setState({ kind: 'failed', reason, python });
    void notifyFailure(undefined, { reason, missing: [] });
  }
}

// ------------------------------------------------------------------ side panel

type Fn = {
  name: string; qualname: string; line: number; col: number; compiled: boolean; graphCount: number;
  breakCount: number; breaks: any[]; run: any | null; running: boolean; relevant: boolean; stale: boolean;
  asRun?: boolean; quiet?: boolean;
};
type Doc = { uri: string; functions: Fn[]; syntaxError: [number, number, string] | null; stale: string[] };
type Node =
  | { kind: 'file'; uri: string; fns: Fn[] }
  | { kind: 'others'; uri: string; fns: Fn[] }
  | { kind: 'fn'; uri: string; fn: Fn }
  | { kind: 'info'; label: string; tooltip?: string | vscode.MarkdownString; icon?: string; command?: vscode.Command; description?: string;
      contextValue?: string }
  | { kind: 'break'; uri: string; brk: any }
  | { kind: 'graph'; uri: string; fn: Fn; graph: any }
  | { kind: 'kernel'; uri: string; fn: Fn; graph: any; kernel: any; index: number };

// A tree row cannot wrap its text, and the side panel is narrow: a row whose text would be cut at
// the panel's default width (about 300 px: `rowChars` characters of the default font, less per
// level of indentation) goes on in continuation rows below it, the key facts on the first.
function rowChars(level: number): number { return 36 - 2 * level; }

// `text` in lines of at most `width` characters: at ' · ' between facts where it can, else at spaces.
function wrapText(text: string, width: number): string[] {
  const lines: string[] = [];
  let line = '';
  const put = (piece: string, sep: string) => {
    if (!line) { line = piece; } else if (line.length + sep.length + piece.length <= width) { line += sep + piece; }
    else { lines.push(line); line = piece; }
  };
  for (const fact of text.split(' · ')) {
    if (fact.length <= width) { put(fact, ' · '); continue; }
    let first = true;
    for (let word of fact.split(' ')) {
      while (word.length > width) { put(word.slice(0, width), first ? ' · ' : ' '); word = word.slice(width); first = false; }
      put(word, first ? ' · ' : ' ');
      first = false;
    }
  }
  if (line) { lines.push(line); }
  return lines;
}

function ms(v: number | null | undefined): string {
  if (v === null || v === undefined) { return '–'; }
  return v >= 1 ? `${v.toFixed(2)} ms` : `${(v * 1000).toFixed(1)} µs`;
}

class FunctionsProvider implements vscode.TreeDataProvider<Node> {
  private emitter = new vscode.EventEmitter<Node | undefined>();
  readonly onDidChangeTreeData = this.emitter.event;
  docs: Doc[] = [];
  private timer: NodeJS.Timeout | undefined;
  // built once per refresh, so that reveal() finds the very nodes the view shows, and their parents
  private roots: Node[] = [];
  private children = new Map<Node, Node[]>();
  private parents = new Map<Node, Node>();
  fnNodes = new Map<string, Node>();

  refreshSoon(): void {
    if (this.timer) { clearTimeout(this.timer); }
    this.timer = setTimeout(() => void this.refresh(), 150);
  }

  async refresh(): Promise<void> {
    if (!client || client.state !== State.Running) { return; }
    try {
      const r: any = await client.sendRequest('fuselens/functions', {});
      this.docs = r?.documents ?? [];
    } catch (e) {
      output.appendLine(`fuselens/functions failed: ${e}`);
    }
    this.build();
    this.emitter.fire(undefined);
    updateStatus();
  }

  // Compiled functions, the ones run, and callees a compiled function's break lies in come
  // first; every other function that uses torch is behind a collapsed "other functions" node.
  private build(): void {
    this.children.clear(); this.parents.clear(); this.fnNodes.clear();
    const docs = this.docs.filter(d => d.functions.length > 0);
    const fileLevel = (d: Doc, parent?: Node): Node[] => {
      const mine = d.functions.filter(f => f.relevant).map(fn => this.fnNode(d.uri, fn, parent));
      const rest = d.functions.filter(f => !f.relevant);
      if (rest.length) {
        const o: Node = { kind: 'others', uri: d.uri, fns: rest };
        this.children.set(o, rest.map(fn => this.fnNode(d.uri, fn, o)));
        if (parent) { this.parents.set(o, parent); }
        mine.push(o);
      }
      return mine;
    };
    if (docs.length === 1) {
      this.roots = fileLevel(docs[0]);
    } else {
      this.roots = docs.map(d => {
        const n: Node = { kind: 'file', uri: d.uri, fns: d.functions };
        this.children.set(n, fileLevel(d, n));
        return n;
      });
    }
  }

  private fnNode(uri: string, fn: Fn, parent?: Node): Node {
    const n: Node = { kind: 'fn', uri, fn };
    this.fnNodes.set(`${uri}#${fn.qualname}`, n);
    if (parent) { this.parents.set(n, parent); }
    return n;
  }

  docFor(uri: string): Doc | undefined { return this.docs.find(d => d.uri === uri); }

  getChildren(node?: Node): Node[] {
    if (!node) { return this.roots; }
    if (node.kind === 'file' || node.kind === 'others') { return this.children.get(node) ?? []; }
    if (node.kind === 'fn') {
      const out: Node[] = [];
      const run = node.fn.run;
      if (node.fn.running) {
        out.push({ kind: 'info', label: 'Compiling and benchmarking…', icon: 'loading~spin' });
      }
      if (run?.restored) {
        out.push(run.stale
          ? { kind: 'info', label: 'Stale: run before the window reload', description: 'the file changed since', icon: 'history',
            tooltip: 'The last Compile & benchmark run of this function, on an older text of the file: its kernels and code may no longer match. Run it again to refresh them.' }
          : { kind: 'info', label: 'Run before the window reload', icon: 'history',
            tooltip: 'The last Compile & benchmark run of this function, on this same text of the file. Run it again to refresh them.' });
      }
      if (run) {
        if (run.status === 'ok') {
          const t = run.timings ?? {};
          if (t.eager && t.fuselens) {
            const cpu = !!t.cpu;
            const how = !cpu ? '' : t.cpuKernels === 'cpp' ? ' C++ kernels' : ' graphs as PyTorch';
            let d = `eager ${ms(t.eager)} · fuselens${how} ${ms(t.fuselens)} (${(t.eager / t.fuselens).toFixed(2)}×)`;
            if (t.torchCompile) { d += ` · torch.compile ${ms(t.torchCompile)} (${(t.eager / t.torchCompile).toFixed(2)}×)`; }
            out.push({ kind: 'info', label: cpu ? 'CPU times (no GPU)' : 'Timings', description: d, icon: 'dashboard',
              tooltip: cpu ? `${d}\n${run.timingNote}` : `${d}\non ${run.gpu}` });
          } else if (run.timingNote) {
            out.push({ kind: 'info', label: 'Not timed', tooltip: run.timingNote, icon: 'info' });
          }
          if (run.check) {
            const c = run.check;
            const random = c.randomOps?.length ? ` (random ops: ${c.randomOps.join(', ')})` : '';
            const label = c.ok ? (c.evalMode ? 'Output matches eager in eval mode' : 'Output matches eager')
              : random ? 'Output not comparable' : 'Output differs from eager';
            out.push({ kind: 'info', label: label + random, description: c.ok && !c.evalMode ? '' : c.message, tooltip: c.message,
              icon: c.ok ? 'pass' : random ? 'info' : 'error' });
          }
          if (run.recompiles?.length) {
            // the run's calls recompiled the function (a guard failing on every call: a counter
            // read as a constant, a size that changes), or the recompile limit stopped compiling it
            const lines = run.recompiles.map((r: any) => r.text);
            out.push({ kind: 'info', label: `Recompiled ${run.recompiles.length}× during the run`,
              description: `guard ${run.recompiles[run.recompiles.length - 1].because}` +
                (run.recompileLimit ? ' · recompile limit reached: runs eagerly' : ''),
              tooltip: [...lines, ...(run.recompileLimit ? [run.recompileLimit] : [])].join('\n'),
              icon: run.recompileLimit ? 'warning' : 'sync' });
          }
          if (run.hasTransformedSource) {
            out.push({ kind: 'info', label: 'Show transformed code', icon: 'go-to-file', command: {
              command: 'fuselens.showTransformedCode', title: 'Show transformed code', arguments: [node.uri, node.fn.qualname] } });
          }
          for (const g of run.graphs) { out.push({ kind: 'graph', uri: node.uri, fn: node.fn, graph: g }); }
        } else {
          out.push({ kind: 'info', label: run.status === 'cancelled' ? 'Cancelled' : 'Compile & benchmark failed',
            description: run.message.split('\n')[0], tooltip: run.message, icon: 'warning' });
        }
      } else if (!node.fn.running) {
        out.push({ kind: 'info', label: 'Compile & benchmark to see kernels', icon: 'play', command: {
          command: 'fuselens.compileAndBenchmark', title: 'Compile & benchmark', arguments: [node.uri, node.fn.qualname] } });
      }
      for (const b of node.fn.breaks) { out.push({ kind: 'break', uri: node.uri, brk: b }); }
      const level = this.level(node) + 1;
      const [, rest] = this.fnLabel(node.fn, level - 1);
      const counts = this.fnCounts(node.fn);
      const head: Node[] = this.fits(node.fn.qualname, counts, level - 1) ? []
        : wrapText((rest ? rest + ' · ' : '') + counts, rowChars(level)).map(l => ({ kind: 'info', label: l, icon: 'blank' }) as Node);
      for (const n of out) { if (n.kind === 'graph') { this.parents.set(n, node); } }
      return [...head, ...out.flatMap(n => this.wrapped(n, level))];
    }
    if (node.kind === 'graph') {
      const level = this.level(node) + 1;
      return node.graph.kernels.flatMap((k: any, i: number) =>
        this.wrapped({ kind: 'kernel', uri: node.uri, fn: node.fn, graph: node.graph, kernel: k, index: i }, level));
    }
    return [];
  }

  private level(node: Node): number {
    let n = 1;
    for (let p = this.parents.get(node); p; p = this.parents.get(p)) { n++; }
    return n;
  }

  private fits(label: string, description: string | undefined, level: number): boolean {
    return label.length + (description ? description.length + 2 : 0) <= rowChars(level);
  }

  // [the function row's label, the rest of its name for the row under it]: a qualname too long
  // for the row is cut after a dot (`VeryLongClassName.` / `forward`)
  private fnLabel(f: Fn, level: number): [string, string] {
    const width = rowChars(level);
    if (f.qualname.length <= width) { return [f.qualname, '']; }
    const cut = f.qualname.lastIndexOf('.', width - 1);
    const at = cut > 0 ? cut + 1 : width;
    return [f.qualname.slice(0, at), f.qualname.slice(at)];
  }

  private fnCounts(f: Fn): string {
    const parts = [`${f.graphCount} graph${f.graphCount === 1 ? '' : 's'}`, `${f.breakCount} break${f.breakCount === 1 ? '' : 's'}`];
    if (f.run?.speedup) { parts.push(`${f.run.speedup.toFixed(2)}× vs eager`); }
    return parts.join(' · ') + (f.asRun ? ' · as run' : f.compiled ? '' : ' · not compiled') + (f.stale ? ' · stale' : '');
  }

  // A row as it would be shown, and the continuation rows its text needs at this level: the
  // same icon-less indentation, command and tooltip (a click on any of them does the same).
  private wrapped(node: Node, level: number): Node[] {
    const it = this.getTreeItem(node);
    const label = typeof it.label === 'string' ? it.label : it.label?.label ?? '';
    const description = typeof it.description === 'string' ? it.description : '';
    if (this.fits(label, description, level)) { return [node]; }
    const width = rowChars(level);
    const lines = [...wrapText(label, width), ...(description ? wrapText(description, width) : [])];
    const rows: Node[] = lines.map((l, i) => ({ kind: 'info', label: l, icon: i ? 'blank' : undefined,
      tooltip: it.tooltip, command: it.command, contextValue: i ? undefined : it.contextValue }) as Node);
    const first = rows[0] as Extract<Node, { kind: 'info' }>;
    first.icon = it.iconPath instanceof vscode.ThemeIcon ? it.iconPath.id : undefined;
    return rows;
  }

  getParent(node: Node): Node | undefined { return this.parents.get(node); }

  functionsWithRuns(): [string, string][] {
    return this.docs.flatMap(d => d.functions.filter(f => f.run?.hasTransformedSource).map(f => [d.uri, f.qualname] as [string, string]));
  }

  // The panel is narrow and a row's text is cut at its edge: every row's tooltip has its whole
  // text (label and description) when the row sets no fuller one.
  getTreeItem(node: Node): vscode.TreeItem {
    const it = this.treeItem(node);
    if (it.tooltip === undefined) {
      const label = typeof it.label === 'string' ? it.label : it.label?.label ?? (node.kind === 'file' ? vscode.Uri.parse(node.uri).fsPath : '');
      it.tooltip = it.description ? `${label}\n${it.description}` : label;
    } else if (typeof it.tooltip === 'string' && typeof it.label === 'string' && !it.tooltip.includes(it.label)) {
      it.tooltip = `${it.label}\n${it.tooltip}`;
    }
    return it;
  }

  private treeItem(node: Node): vscode.TreeItem {
    const C = vscode.TreeItemCollapsibleState;
    switch (node.kind) {
      case 'file': {
        const it = new vscode.TreeItem(vscode.Uri.parse(node.uri), C.Expanded);
        it.iconPath = vscode.ThemeIcon.File;
        return it;
      }
      case 'others': {
        const it = new vscode.TreeItem(`${node.fns.length} other function${node.fns.length === 1 ? '' : 's'} (not compiled)`, C.Collapsed);
        it.tooltip = 'Functions that use torch but are not compiled, and are not on the way to a break of a compiled function';
        it.iconPath = new vscode.ThemeIcon('filter');
        it.id = `${node.uri}#others`;
        return it;
      }
      case 'fn': {
        const f = node.fn;
        const it = new vscode.TreeItem(this.fnLabel(f, this.level(node))[0], f.run || f.breakCount || f.running ? C.Expanded : C.Collapsed);
        const counts = this.fnCounts(f);
        // too long for one row: the counts are the first row under it (getChildren)
        it.description = this.fits(f.qualname, counts, this.level(node)) ? counts : undefined;
        it.tooltip = `${f.qualname}\n${counts}` + (f.asRun ? '\nGraphs and breaks of the last Compile & benchmark run on this text of the file' : '');
        it.iconPath = new vscode.ThemeIcon(f.breakCount ? 'debug-breakpoint-unverified' : 'symbol-function');
        it.contextValue = f.run?.hasTransformedSource ? 'function-compiled-run' : 'function';
        it.id = `${node.uri}#${f.qualname}`;
        it.command = { command: 'vscode.open', title: 'Go to function', arguments: [vscode.Uri.parse(node.uri),
          { selection: new vscode.Range(f.line, f.col, f.line, f.col) }] };
        return it;
      }
      case 'info': {
        const it = new vscode.TreeItem(node.label, C.None);
        it.description = node.description;
        it.tooltip = node.tooltip;
        if (node.icon) { it.iconPath = new vscode.ThemeIcon(node.icon); }
        it.command = node.command;
        it.contextValue = node.contextValue;
        return it;
      }
      case 'break': {
        const b = node.brk;
        const it = new vscode.TreeItem(`line ${b.line + 1} · ${b.code} ${b.title}`, C.None);
        it.tooltip = new vscode.MarkdownString(`**${b.code}** ${b.title}\n\n${b.explanation}\n\n*Hint:* ${b.hint}\n\n[docs](${b.docUrl})`);
        it.iconPath = new vscode.ThemeIcon('warning');
        it.command = { command: 'vscode.open', title: 'Go to break', arguments: [vscode.Uri.parse(node.uri),
          { selection: new vscode.Range(b.line, b.col, b.endLine, b.endCol) }] };
        return it;
      }
      case 'graph': {
        const g = node.graph;
        const it = new vscode.TreeItem(`graph ${g.index}`, C.Expanded);
        it.description = `${g.kernels.length} kernel${g.kernels.length === 1 ? '' : 's'}` + (g.nodeCount != null ? ` · ${g.nodeCount} ops` : '');
        it.iconPath = new vscode.ThemeIcon('type-hierarchy');
        it.command = { command: 'fuselens.openGraph', title: 'Open graph IR', arguments: [node.uri, node.fn.qualname, g.index] };
        return it;
      }
      case 'kernel': {
        const k = node.kernel;
        const it = new vscode.TreeItem(k.name, C.None);
        const d: string[] = [];
        if (k.timeMs != null) { d.push(ms(k.timeMs)); }
        if (k.share != null) { d.push(`${(k.share * 100).toFixed(0)}%`); }
        if (k.bandwidthGBs != null) { d.push(`${k.bandwidthGBs.toFixed(0)} GB/s`); }
        it.description = d.join(' · ');
        it.tooltip = `${k.name}\n${k.lines} lines of ${k.language === 'cpp' ? 'C++' : 'Triton'}` +
          (d.length ? `\n${d.join(' · ')}` : k.language === 'cpp' ? '' : '\n(not timed: no GPU)');
        it.iconPath = new vscode.ThemeIcon('zap');
        it.contextValue = 'kernel';
        it.command = { command: 'fuselens.openKernel', title: 'Open kernel source',
          arguments: [node.uri, node.fn.qualname, node.graph.index, k.name, k.language ?? 'triton'] };
        return it;
      }
    }
  }
}

// ------------------------------------------------------------------ virtual documents

class KernelDocs implements vscode.TextDocumentContentProvider, vscode.DefinitionProvider, vscode.HoverProvider {
  private cache = new Map<string, any>();
  private emitter = new vscode.EventEmitter<vscode.Uri>();
  readonly onDidChange = this.emitter.event;

  // a kernel's document: `.fl-triton` (GPU kernels) or `.fl-cpp` (a CPU graph's C++ kernels)
  static kernelUri(uri: string, qualname: string, graph: number, kernel: string, language = 'triton'): vscode.Uri {
    const q = new URLSearchParams({ uri, qualname, graph: String(graph), kernel }).toString();
    return vscode.Uri.from({ scheme: SCHEME, path: `/${qualname}/${kernel}.fl-${language === 'cpp' ? 'cpp' : 'triton'}`, query: q });
  }

  async provideTextDocumentContent(u: vscode.Uri): Promise<string> {
    const q = new URLSearchParams(u.query);
    const params = { uri: q.get('uri'), qualname: q.get('qualname'), graph: Number(q.get('graph') ?? 0), kernel: q.get('kernel') };
    if (starting) { await starting.catch(() => undefined); }  // views restored by a reload come first
    if (!client || client.state !== State.Running) { return '# the fuselens language server is not running'; }
    if (u.path.endsWith('.fl-triton') || u.path.endsWith('.fl-cpp')) {
      const k: any = await client.sendRequest('fuselens/kernel', params);
      if (!k) { return '# this kernel is no longer available: run Compile & benchmark again'; }
      this.cache.set(u.toString(), k);
      return k.source;
    }
    if (u.path.endsWith('.fl-graph')) {
      const g: any = await client.sendRequest('fuselens/graph', params);
      return g ? g.ir + (g.wrapper ? `\n\n# ---- wrapper ----\n${g.wrapper}` : '') : '# graph not available';
    }
    const t: any = await client.sendRequest('fuselens/transformedSource', params);
    return t ? t.source : '# transformed code not available: run Compile & benchmark first';
  }

  // The fuselens views open in editors (after a reload, read before the server had the runs).
  refreshOpen(): void {
    for (const d of vscode.workspace.textDocuments) {
      if (d.uri.scheme === SCHEME) { this.emitter.fire(d.uri); }
    }
  }

  // Following the cursor in a kernel: highlight, in the source editor beside it, the source
  // range the kernel line came from (and, lightly, every source line the kernel computes).
  private lineDeco = vscode.window.createTextEditorDecorationType({
    backgroundColor: new vscode.ThemeColor('editor.findMatchHighlightBackground'),
    isWholeLine: false,
  });
  private kernelDeco = vscode.window.createTextEditorDecorationType({
    backgroundColor: new vscode.ThemeColor('editor.rangeHighlightBackground'),
    isWholeLine: true,
  });

  followCursor(ed: vscode.TextEditor | undefined): void {
    const k = ed && ed.document.uri.scheme === SCHEME ? this.cache.get(ed.document.uri.toString()) : undefined;
    for (const other of vscode.window.visibleTextEditors) {
      if (other.document.uri.scheme === SCHEME) { continue; }
      const mine = k && other.document.uri.toString() === k.uri;
      other.setDecorations(this.kernelDeco, mine ? (k.sourceLines ?? []).map((l: number) => new vscode.Range(l, 0, l, 0)) : []);
      if (!mine) { other.setDecorations(this.lineDeco, []); continue; }
      const p = (k.provenance ?? []).filter((x: any) => x.kernelLine === ed!.selection.active.line);
      const ranges = p.map((x: any) => new vscode.Range(x.line, x.col, x.endLine, x.endCol));
      other.setDecorations(this.lineDeco, ranges);
      if (ranges.length) { other.revealRange(ranges[0], vscode.TextEditorRevealType.InCenterIfOutsideViewport); }
    }
  }

  private provenanceAt(doc: vscode.TextDocument, line: number): { k: any; p: any[] } | undefined {
    const k = this.cache.get(doc.uri.toString());
    if (!k) { return undefined; }
    const p = (k.provenance ?? []).filter((x: any) => x.kernelLine === line);
    return p.length ? { k, p } : undefined;
  }

  provideDefinition(doc: vscode.TextDocument, pos: vscode.Position): vscode.Location[] | undefined {
    const hit = this.provenanceAt(doc, pos.line);
    if (!hit) { return undefined; }
    const src = vscode.Uri.parse(hit.k.uri);
    return hit.p.map((x: any) => new vscode.Location(src, new vscode.Range(x.line, x.col, x.endLine, x.endCol)));
  }

  provideHover(doc: vscode.TextDocument, pos: vscode.Position): vscode.Hover | undefined {
    const hit = this.provenanceAt(doc, pos.line);
    if (!hit) { return undefined; }
    const src = vscode.Uri.parse(hit.k.uri);
    const lines = hit.p.map((x: any) => `[${path.basename(src.fsPath)}:${x.line + 1}](${src.with({ fragment: `L${x.line + 1}` })})`);
    return new vscode.Hover(new vscode.MarkdownString(`From source ${lines.join(', ')} (F12 goes there)`));
  }
}

// ------------------------------------------------------------------ commands

// Kernel, graph and transformed-code views share one editor column: the one a fuselens view is
// already shown in, else the column right of the source; never a new column per click.
function viewerColumn(sourceUri: string): vscode.ViewColumn {
  const viewer = vscode.window.visibleTextEditors.find(e => e.document.uri.scheme === SCHEME && e.viewColumn);
  if (viewer?.viewColumn) { return viewer.viewColumn; }
  const src = vscode.window.visibleTextEditors.find(e => e.document.uri.toString() === sourceUri && e.viewColumn);
  return src?.viewColumn ? src.viewColumn + 1 : vscode.ViewColumn.Beside;
}

// The status bar item: the server's state until it is ready; then the active file's graph
// breaks, or why its results are stale.
function updateStatus(): void {
  if (!status) { return; }
  const st = serverState;
  if (st.kind !== 'ready') {
    if (st.kind === 'starting') {
      status.text = '$(sync~spin) fuselens: starting';
      status.tooltip = `Starting the fuselens language server${st.python ? ` with ${st.python}` : ''}`;
      status.command = 'fuselens.showOutput';
    } else {
      status.text = '$(error) fuselens: not running';
      status.tooltip = `The fuselens language server is not running: ${st.reason}.\nClick for what to do.`;
      status.command = 'fuselens.showServerProblem';
    }
    status.show();
    return;
  }
  const ed = vscode.window.activeTextEditor;
  const d = ed && ed.document.languageId === 'python' ? tree.docFor(ed.document.uri.toString()) : undefined;
  if (!d) {
    status.text = '$(check) fuselens';
    status.tooltip = `The fuselens language server is running (${st.python})`;
    status.command = 'fuselens.functions.focus';
    status.show();
    return;
  }
  const breaks = d.functions.filter(f => f.compiled).reduce((n, f) => n + f.breakCount, 0);
  if (d.syntaxError) {
    const [line, , msg] = d.syntaxError;
    status.text = `$(warning) fuselens: syntax error on line ${line}`;
    status.tooltip = `Line ${line}: ${msg}.\n` + (d.stale.length
      ? `Showing the last results that parsed for ${d.stale.map(q => '`' + q + '`').join(', ')} (marked stale) until it parses again.`
      : 'The rest of the file is analysed without that statement.');
    status.command = { command: 'vscode.open', title: 'Go to the syntax error',
      arguments: [ed!.document.uri, { selection: new vscode.Range(line - 1, 0, line - 1, 0) }] };
  } else {
    status.text = `$(${breaks ? 'debug-breakpoint-unverified' : 'check'}) fuselens: ${breaks} graph break${breaks === 1 ? '' : 's'}`;
    status.tooltip = 'Graph breaks in the compiled functions of this file';
    status.command = 'fuselens.functions.focus';
  }
  status.show();
}

async function compileAndBenchmark(arg?: any, qualname?: string): Promise<void> {
  if (!client || serverState.kind !== 'ready') {
    const why = serverState.kind === 'failed' ? `is not running: ${serverState.reason}` : 'is still starting';
    void vscode.window.showWarningMessage(`fuselens: the language server ${why}.`);
    return;
  }
  let uri: string | undefined;
  let target: any;
  if (typeof arg === 'string') { uri = arg; target = qualname; }
  else if (arg && typeof arg === 'object' && arg.kind === 'fn') { uri = arg.uri; target = arg.fn.qualname; }
  else {
    const ed = vscode.window.activeTextEditor;
    if (!ed || ed.document.languageId !== 'python') {
      void vscode.window.showWarningMessage('fuselens: open a Python file and put the cursor in a function.');
      return;
    }
    uri = ed.document.uri.toString();
    target = { line: ed.selection.active.line, character: ed.selection.active.character };
  }
  tree.refreshSoon();
  let r: any = await runOnServer(uri!, target, {});
  await tree.refresh();
  if (r?.canRunMain) {
    // found no inputs without running anything: running the `__main__` block is the user's call
    const run = 'Run the __main__ block';
    const pick = await vscode.window.showWarningMessage(`fuselens: Compile & benchmark \`${r.qualname}\`: ${r.message}`, run);
    if (pick === run && client) {
      r = await runOnServer(uri!, r.qualname, { runMain: true });
      await tree.refresh();
    }
  }
  if (r?.status) { await saveRun(uri!, r); }
  if (r?.qualname) { await revealFunction(uri!, r.qualname); }
}

let runCount = 0;

// One Compile & benchmark on the server, its progress in a notification of ours so that Cancel
// shows from the start (progress the server creates itself shows in the status bar only).
async function runOnServer(uri: string, target: any, options: Record<string, unknown>): Promise<any> {
  const c = client!;
  const what = typeof target === 'string' ? `\`${target}\`` : 'the function at the cursor';
  return vscode.window.withProgress(
    { location: vscode.ProgressLocation.Notification, title: `fuselens: Compile & benchmark ${what}`, cancellable: true },
    async (progress, cancel) => {
      const progressToken = `fuselens-run-${process.pid}-${++runCount}`;
      let reported = 0;
      const onProgress = c.onProgress(WorkDoneProgress.type, progressToken, v => {
        if (v.kind === 'end') { return; }
        const increment = v.percentage != null ? Math.max(0, v.percentage - reported) : undefined;
        reported += increment ?? 0;
        progress.report({ message: v.message, increment });
      });
      const onCancel = cancel.onCancellationRequested(() =>
        void c.sendNotification(WorkDoneProgressCancelNotification.type, { token: progressToken }));
      try {
        return await c.sendRequest(ExecuteCommandRequest.type,
          { command: 'fuselens.server.compileAndBenchmark', arguments: [uri, target, { ...options, progressToken }] });
      } finally {
        onProgress.dispose();
        onCancel.dispose();
      }
    });
}

async function revealFunction(uri: string, qualname: string): Promise<void> {
  await vscode.commands.executeCommand('fuselens.functions.focus');
  await tree.refresh();
  const n = tree.fnNodes.get(`${uri}#${qualname}`);
  if (n) { await treeView.reveal(n, { select: true, focus: false, expand: 2 }).then(undefined, () => undefined); }
}

export async function activate(ctx: vscode.ExtensionContext): Promise<void> {
  extensionContext = ctx;
  output = vscode.window.createOutputChannel('fuselens', { log: true });
  tree = new FunctionsProvider();
  kernelDocs = new KernelDocs();
  treeView = vscode.window.createTreeView('fuselens.functions', { treeDataProvider: tree, showCollapseAll: true });
  status = vscode.window.createStatusBarItem('fuselens.status', vscode.StatusBarAlignment.Left, 50);
  status.name = 'fuselens';
  ctx.subscriptions.push(
    output, treeView, status,
    vscode.workspace.registerTextDocumentContentProvider(SCHEME, kernelDocs),
    ...['fuselens-triton', 'fuselens-cpp'].flatMap(language => [
      vscode.languages.registerDefinitionProvider({ scheme: SCHEME, language }, kernelDocs),
      vscode.languages.registerHoverProvider({ scheme: SCHEME, language }, kernelDocs)]),
    vscode.commands.registerCommand('fuselens.compileAndBenchmark', compileAndBenchmark),
    vscode.commands.registerCommand('fuselens.revealFunction', revealFunction),
    vscode.commands.registerCommand('fuselens.refresh', () => tree.refresh()),
    vscode.commands.registerCommand('fuselens.openKernel', async (uri: string, qualname: string, graph: number, kernel: string,
                                                                 language = 'triton') => {
      const doc = await vscode.workspace.openTextDocument(KernelDocs.kernelUri(uri, qualname, graph, kernel, language));
      await vscode.languages.setTextDocumentLanguage(doc, language === 'cpp' ? 'fuselens-cpp' : 'fuselens-triton');
      await vscode.window.showTextDocument(doc, { preview: true, viewColumn: viewerColumn(uri) });
    }),
    vscode.commands.registerCommand('fuselens.openGraph', async (uri: string, qualname: string, graph: number) => {
      const q = new URLSearchParams({ uri, qualname, graph: String(graph) }).toString();
      const doc = await vscode.workspace.openTextDocument(vscode.Uri.from({ scheme: SCHEME, path: `/${qualname}/graph${graph}.fl-graph`, query: q }));
      await vscode.languages.setTextDocumentLanguage(doc, 'fuselens-graph');
      await vscode.window.showTextDocument(doc, { preview: true, viewColumn: viewerColumn(uri) });
    }),
    vscode.commands.registerCommand('fuselens.showTransformedCode', async (arg?: any, qn?: string) => {
      let uri = typeof arg === 'string' ? arg : arg?.uri;
      let qualname = typeof arg === 'string' ? qn : arg?.fn?.qualname;
      if (!uri || !qualname) {
        const sel = treeView.selection[0];
        if (sel && (sel.kind === 'fn' || sel.kind === 'graph' || sel.kind === 'kernel')) { uri = sel.uri; qualname = sel.fn.qualname; }
      }
      if (!uri || !qualname) {
        const ran = tree.functionsWithRuns();
        if (ran.length === 1) { [uri, qualname] = ran[0]; }
      }
      if (!uri || !qualname) { void vscode.window.showWarningMessage('fuselens: select a function in the fuselens panel.'); return; }
      const q = new URLSearchParams({ uri, qualname }).toString();
      const doc = await vscode.workspace.openTextDocument(vscode.Uri.from({ scheme: SCHEME, path: `/${qualname}.transformed.py`, query: q }));
      await vscode.window.showTextDocument(doc, { preview: true, viewColumn: viewerColumn(uri) });
    }),
    vscode.commands.registerCommand('fuselens.restartServer', () => { notified = ''; return restartServer(); }),
    vscode.commands.registerCommand('fuselens.showOutput', () => output.show()),
    vscode.commands.registerCommand('fuselens.showServerProblem', async () => {
      if (serverState.kind !== 'failed') { output.show(); return; }
      notified = '';
      const py = await findInterpreter();
      const check = await checkInterpreter(py);
      if (check.ok) { await restartServer(); return; }
      await notifyFailure(check.missing.length ? py : undefined, check);
    }),
    vscode.window.onDidChangeTextEditorSelection(e => kernelDocs.followCursor(e.textEditor)),
    vscode.window.onDidChangeActiveTextEditor(ed => { kernelDocs.followCursor(ed); updateStatus(); }),
    // trusted now: an interpreter inside the workspace may be run, and the server may run code
    vscode.workspace.onDidGrantWorkspaceTrust(() => { notified = ''; void restartServer(); }),
    vscode.workspace.onDidChangeConfiguration(e => {
      if (e.affectsConfiguration('fuselens.pythonPath')) { notified = ''; void restartServer(); }
    }),
  );
  // the Python extension's interpreter changed: the server runs on the new one
  const api = await pythonExtensionApi();
  const onEnv = api?.environments?.onDidChangeActiveEnvironmentPath;
  if (typeof onEnv === 'function') {
    ctx.subscriptions.push(onEnv(() => {
      if (!vscode.workspace.getConfiguration('fuselens').get<string>('pythonPath', '').trim()) { notified = ''; void restartServer(); }
    }));
  }
  // a .venv made after the window opened: picked up when nothing was found before
  const venvs = vscode.workspace.createFileSystemWatcher('**/{.venv,venv}/{bin/python,Scripts/python.exe}');
  venvs.onDidCreate(() => { if (serverState.kind === 'failed') { notified = ''; void restartServer(); } });
  ctx.subscriptions.push(venvs);
  closeEmptyGroups();
  starting = startClient(ctx);
  await starting;
}

// A window reload can leave the column of fuselens views empty (a view it could not restore):
// an empty editor group at activation is closed, unless it is the only one.
function closeEmptyGroups(): void {
  const groups = vscode.window.tabGroups.all;
  const empty = groups.filter(g => g.tabs.length === 0);
  if (empty.length && empty.length < groups.length) {
    void vscode.window.tabGroups.close(empty).then(undefined, e => output.appendLine(`fuselens: could not close an empty editor group: ${e}`));
  }
}

export async function deactivate(): Promise<void> {
  if (client) { await client.stop(); }
}
