// Writes src/report.ts, the TypeScript types of what the renderer reads, from two JSON Schemas:
//   ../tfmem_magic/report.schema.json  the report (made from the Python dataclasses by tfmem_magic.core.schema)
//   schema/view.schema.json            the `view` block that tfmem_magic.show.render.mime_bundle adds to it
// `npm run types` regenerates the file after either schema changed; `npm run types:check` (run by
// tests/integration/test_labextension.py) fails while the file is stale.
import { readFileSync, writeFileSync } from 'node:fs';
import { dirname, join, relative } from 'node:path';
import { fileURLToPath } from 'node:url';

import { compile } from 'json-schema-to-typescript';
import prettier from 'prettier';

const root = join(dirname(fileURLToPath(import.meta.url)), '..');
const SCHEMAS = [
  { file: join(root, '..', 'tfmem_magic', 'report.schema.json'), name: 'Report', what: 'the report' },
  { file: join(root, 'schema', 'view.schema.json'), name: 'ReportView', what: "the bundle's view block" }
];
const OUT = join(root, 'src', 'report.ts');

const HEADER = `/**
 * GENERATED FILE, do not edit: made by \`npm run types\` (scripts/types.mjs, json-schema-to-typescript) from
${SCHEMAS.map(s => ` *   ${relative(join(root, '..'), s.file)} (${s.what}: ${s.name})`).join('\n')}
 * After a schema changed, run \`cd labextension && npm run types\`: tests/integration/test_labextension.py fails
 * until then.
 */
`;

async function generate() {
  const parts = [];
  for (const { file, name } of SCHEMAS) {
    const schema = JSON.parse(readFileSync(file, 'utf8'));
    // the root type's name is ours: json-schema-to-typescript would make one of the schema's $id or title
    const root = { ...schema, description: [schema.title, schema.description].filter(Boolean).join(': ') };
    delete root.$id;
    delete root.title;
    const code = await compile(root, name, {
      bannerComment: '',
      format: false,
      additionalProperties: false,
      unknownAny: true,
      strictIndexSignatures: true
    });
    parts.push(code.trim());
  }
  const names = parts.join('\n').match(/^export (?:interface|type) \w+/gm) ?? [];
  const twice = names.filter((n, i) => names.indexOf(n) !== i);
  if (twice.length) {
    throw new Error(`the schemas both define ${twice.join(', ')}: rename one of them`);
  }
  const options = (await prettier.resolveConfig(OUT)) ?? {};
  return prettier.format(HEADER + '\n' + parts.join('\n\n') + '\n', { ...options, filepath: OUT });
}

const text = await generate();
if (process.argv.includes('--check')) {
  let current = '';
  try {
    current = readFileSync(OUT, 'utf8');
  } catch {
    // missing: stale
  }
  if (current !== text) {
    console.error(`${relative(process.cwd(), OUT)} is stale: run \`npm run types\` in labextension/`);
    process.exit(1);
  }
  console.log(`${relative(process.cwd(), OUT)} is up to date`);
} else {
  writeFileSync(OUT, text);
  console.log(`wrote ${relative(process.cwd(), OUT)}`);
}
