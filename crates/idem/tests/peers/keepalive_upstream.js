// A test upstream on Node's http module: keep-alive connections idle for longer than keepAliveTimeout
// (argv[2], milliseconds) are closed by the server, as Node services close them (default 5 s).
//
// POST: counts one execution under the request's Idempotency-Key, answers 201. GET: the counts as JSON.
// Prints its port on the first line of standard output.
const http = require('http');

const counts = {};
const server = http.createServer((req, res) => {
  req.resume();
  req.on('end', () => {
    if (req.method === 'POST') {
      const key = req.headers['idempotency-key'] || '';
      counts[key] = (counts[key] || 0) + 1;
      res.writeHead(201, { 'content-type': 'application/json' });
      res.end('{"ok":true}');
    } else {
      res.writeHead(200, { 'content-type': 'application/json' });
      res.end(JSON.stringify(counts));
    }
  });
});
server.keepAliveTimeout = Number(process.argv[2]);
server.listen(0, '127.0.0.1', () => console.log(server.address().port));
