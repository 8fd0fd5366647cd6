// Bundles the extension (and vscode-languageclient) into out/extension.js with esbuild.
import * as esbuild from 'esbuild';
import { fileURLToPath } from 'node:url';
import path from 'node:path';

const root = path.dirname(path.dirname(fileURLToPath(import.meta.url)));
const production = process.argv.includes('--production');
const opts = {
  entryPoints: [path.join(root, 'extension/src/extension.ts')],
  bundle: true,
  outfile: path.join(root, 'out/extension.js'),
  external: ['vscode'],
  format: 'cjs',
  platform: 'node',
  target: 'node18',
  sourcemap: !production,
  minify: production,
  logLevel: 'info',
};
if (process.argv.includes('--watch')) {
  const ctx = await esbuild.context(opts);
  await ctx.watch();
} else {
  await esbuild.build(opts);
}
